"""The Llama-family model: config parsing, RoPE, the decoder over the paged cache, loading, make-model."""
