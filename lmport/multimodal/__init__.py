"""Images in, text out: decoding and checking images (``images``), the model's image processor and the prompt's
placeholders (``processor``), what an image is as the engine carries it (``inputs``) and Qwen's multimodal rotary
positions (``mrope``). docs/vision.md says what is served and what is not."""
