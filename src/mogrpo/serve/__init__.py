"""`mogrpo serve`: a model behind the OpenAI chat-completions API — the batching server
(`server`) and the request/response format (`api`)."""
