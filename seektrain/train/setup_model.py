"""The workers' check that every rank reads the same Hugging Face folder. Which model a job trains is
``models/job_model.py``'s (``configured_model_config``)."""

from __future__ import annotations

from seektrain.errors import UserError


def check_same_folder(hf_path: str, world_size: int) -> None:
    """Every rank reads its own slices of ``model.hf_path``, so every rank must see the same model there
    (node-local copies can differ): the folders' fingerprints are compared, a UserError names the
    first rank whose copy differs from rank 0's."""
    if world_size == 1:
        return
    import torch.distributed as dist

    from seektrain.checkpoint.lora_base import hf_fingerprint

    mine = hf_fingerprint(hf_path)
    every: list[str | None] = [None] * world_size
    dist.all_gather_object(every, mine)
    for rank, other in enumerate(every):
        if other != every[0]:
            raise UserError(
                f"model.hf_path={hf_path}: rank {rank} sees a different model there than rank 0 "
                f"(fingerprint {str(other)[:12]} vs {str(every[0])[:12]}); give every node the same copy"
            )
