"""Other engines: export to vLLM / SGLang / llama.cpp layouts, and a llama-server driver."""
