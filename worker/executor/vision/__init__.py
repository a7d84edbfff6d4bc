"""Images beside tokens: vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA,
LLaVA-NeXT, LLaVA-OneVision, Gemma-3, SmolVLM, Idefics3, Mistral-3) scored exactly.

``arch`` says which models are served (others refused at load, naming the class) and each one's
rule (token count per run of each image, positions, vision tower, extra inputs; ``anyres`` and
``pixtral`` hold LLaVA-NeXT's / OneVision's and Mistral-3's), ``decode`` turns a job's
encoded files into images under the worker's limits, ``processor`` runs the model's own image
processor once per distinct image (cached by content hash and options), ``intake`` checks each
sequence's image-token runs against the processor's counts and computes its positions by the
model's own rule, ``features`` runs the vision tower once per distinct image of a batch (and
adds Gemma-3's ``token_type_ids``). docs/executor.md, *Images*.
"""
