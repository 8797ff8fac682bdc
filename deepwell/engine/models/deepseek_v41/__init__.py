"""DeepSeek-V4.1: the released checkpoint format, Engram hashing and cache formats (spec/deepseek_v41.md)."""
