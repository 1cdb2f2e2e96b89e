"""Interoperability with other model formats (Hugging Face Llama): see docs/hf_interop.md."""
