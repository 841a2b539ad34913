"""Model code. One file per family; Llama covers Llama 2/3, Qwen2 and Mistral."""
