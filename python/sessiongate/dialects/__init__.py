"""Agent API dialects converted to and from the OpenAI chat contract the engines serve."""
