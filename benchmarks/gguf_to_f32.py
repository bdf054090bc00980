"""Write an F32 copy of a GGUF file: every tensor dequantized to float32, all metadata kept.

llama.cpp then runs the same weights tokenmill's float32 path runs (the default model's float32
weights are its GGUF file's, dequantized), so the two compare on equal bytes per token::

    pip install gguf   # in the llama-cpp-python environment; not a tokenmill dependency
    python benchmarks/gguf_to_f32.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-f32.gguf
    python benchmarks/quant_vs_llamacpp.py --engines float32,llamacpp \\
        --llamacpp-python /path/to/llama-venv/bin/python --llamacpp-gguf /tmp/smollm2-f32.gguf
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np


def convert(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data.reshape(tuple(int(d) for d in reversed(tensor.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args()
    convert(args.src, args.dst)
