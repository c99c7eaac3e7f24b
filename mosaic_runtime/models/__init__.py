"""Models: a recipe read from the vault's arch block (recipe.py), the family's tensor names (families.py),
and one decoder that runs every recipe (decoder.py: the torch reference; native_step.py: the native
decode step)."""

from __future__ import annotations

from typing import Mapping

import torch

from ..experts import ExpertExecutor
from .decoder import Decoder
from .families import FAMILIES
from ..recipe import ModelRecipe, read_recipe
from .weights import Matrix, load_weights, split_latent_kv


def model_recipe(arch: dict) -> ModelRecipe:
    """The recipe of a vault's arch block, refused (NotImplementedError) when this runtime cannot run it."""
    recipe = read_recipe(arch)
    if recipe.model_type not in FAMILIES:
        raise NotImplementedError(f"model_type {recipe.model_type!r} has no runtime model "
                                  f"(supported: {', '.join(sorted(FAMILIES))})")
    return recipe


def prepare_tensors(recipe: ModelRecipe, tensors: dict, backbone: str) -> dict:
    """What the model derives from the backbone before it is laid out in memory (latent attention's
    kv_b_proj split and quantised as the backbone mode says: weights.split_latent_kv)."""
    return split_latent_kv(recipe, FAMILIES[recipe.model_type], tensors, backbone)


def build_model(recipe: ModelRecipe, tensors: Mapping[str, Matrix], experts: ExpertExecutor, max_seq: int,
                kv_dtype: torch.dtype = torch.float32) -> Decoder:
    return Decoder(recipe, load_weights(recipe, FAMILIES[recipe.model_type], tensors), experts, max_seq, kv_dtype)


__all__ = ["Decoder", "FAMILIES", "ModelRecipe", "build_model", "model_recipe"]
