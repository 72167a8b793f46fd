"""OpenAI's API: chat and completions, tool calling, reasoning, the Responses API, embeddings."""
