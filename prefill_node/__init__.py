"""The prefill node: computes prompts, samples the first token, holds the KV for a decode node."""
