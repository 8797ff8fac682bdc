"""Images in requests: where their bytes come from, their checks, and the pixels and prompt
spans DeepSeek-V4.1's vision tower reads (docs/serve.md, "Images")."""
