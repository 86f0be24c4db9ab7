"""The DeepSeek family (DeepSeek-LLM dense, DeepSeek-V2, DeepSeek-V3): its model, attention (MHA/GQA and
MLA), DeepSeekMoE, shape description, presets and Hugging Face state-dict adapter. Only this folder and the
registry entry (``models/registry.py``) import these modules; generic code asks the registry."""
