"""The decode node: continues prefilled requests (pulling their KV) and streams the output tokens."""
