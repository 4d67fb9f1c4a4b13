"""Server-side jobs on public data and a public LLM (GPU when present, CPU otherwise)."""
