"""Other ecosystems: hf (Hugging Face checkpoints both ways), safetensors_file (the file format,
no torch), lm_eval (lm-evaluation-harness model "focaljax")."""
