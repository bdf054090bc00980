"""First-party model architectures, registered through the ``tokenmill.plugins`` entry point.

Registration is by ``module:Class`` string; model code is imported only when a checkpoint asks
for it.
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_models(register):
    register("LlamaForCausalLM", "tokenmill.models.llama:LlamaForCausalLM")
    register("MistralForCausalLM", "tokenmill.models.llama:MistralForCausalLM")
    register("Qwen2ForCausalLM", "tokenmill.models.qwen2:Qwen2ForCausalLM")
    register("DeepseekV2ForCausalLM", "tokenmill.models.deepseek_v2:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "tokenmill.models.deepseek_v2:DeepseekV3ForCausalLM")
    register("DeepSeekMTPModel", "tokenmill.models.deepseek_mtp:DeepSeekMTP")
    register("EagleLlamaForCausalLM", "tokenmill.models.llama_eagle:EagleLlamaForCausalLM")
    register("Eagle3LlamaForCausalLM", "tokenmill.models.llama_eagle3:Eagle3LlamaForCausalLM")
    register("LlamaForCausalLMEagle3", "tokenmill.models.llama_eagle3:Eagle3LlamaForCausalLM")
