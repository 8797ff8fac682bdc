"""deepwell: serve DeepSeek models behind the OpenAI and Anthropic APIs."""

__version__ = "0.1.0"
