"""The gateway: the OpenAI API in front of SGLang-style prefill/decode engines."""
