"""The engine: engine core step loop, request bookkeeping and detokenization."""
