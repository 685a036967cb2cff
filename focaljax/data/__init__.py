"""Input data: sources (documents) -> tokenizer -> pipeline (packed, checkpointable batches);
retrieval (passkey and keyword prompts and training drills); tfds_text (local files as TFDS)."""
