"""A token search past the stored depth (ffmem.engine.live.token_search) for every family: each token's logit
in every value's readout equals the projection's (the stored table's numbers; the final norm split into each
value's scale and mean, then one product), the log Zs are the projection's, and the ranking's first `depth`
pairs are the token → memories table's lists, the rest the brute force's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny
from test_token_memories import _loaded, _table

from ffmem.engine.live.token_search import token_logits, token_search, value_log_z, value_scales
from ffmem.engine.values.projection import READOUTS, value_logits
from ffmem.engine.values.token_memories import LISTS

DEPTH = 10


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def loaded(request):
    return _loaded(_tiny(request.param), request.param.name)


@pytest.fixture(scope="module")
def every_logit(loaded) -> dict[str, torch.Tensor]:
    """readout → the projection's logits of every value over the whole vocabulary, [memories, vocab]."""
    values = torch.cat([loaded.adapter.value_matrix(b) for b in loaded.adapter.blocks(loaded.model)])
    with torch.no_grad():
        return {readout: value_logits(loaded, values, readout).float() for readout in READOUTS}


@pytest.mark.parametrize("readout", READOUTS)
def test_token_logits_and_log_z_are_the_projections(loaded, every_logit, readout):
    tokens = [0, 7, every_logit[readout].shape[1] - 1]
    got = token_logits(loaded, tokens, readout, value_scales(loaded))  # [memories, tokens]
    torch.testing.assert_close(got, every_logit[readout][:, tokens], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_logits(loaded, tokens, readout), got)  # scales computed when not given
    torch.testing.assert_close(
        value_log_z(loaded, readout), torch.logsumexp(every_logit[readout], dim=-1), rtol=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("readout", READOUTS)
@pytest.mark.parametrize("by", ["logit", "prob"])
def test_the_first_depth_are_the_tables_the_rest_the_brute_forces(loaded, every_logit, readout, by):
    memories, scores = _table(loaded, readout, DEPTH)  # [vocab, lists, depth] each
    token = 5
    limit = 3 * DEPTH
    found = token_search(
        loaded, [token], readout=readout, by=by, limit=limit, log_z=value_log_z(loaded, readout)
    )
    logits = every_logit[readout].double()  # [memories, vocab]
    score = logits[:, token] - (torch.logsumexp(logits, dim=-1) if by == "prob" else 0)  # [memories]
    for direction in (1, -1):
        listed = LISTS.index((by, direction))
        pairs = found[direction]
        assert [t for _, t, _ in pairs] == [token] * limit
        assert [m for m, _, _ in pairs[:DEPTH]] == memories[token, listed].tolist(), "the table's lists"
        np.testing.assert_allclose(
            [s for _, _, s in pairs[:DEPTH]], scores[token, listed], rtol=1e-5, atol=1e-5
        )
        order = np.argsort(-direction * score.numpy(), kind="stable")[:limit]  # the brute force
        assert [m for m, _, _ in pairs] == order.tolist()
        np.testing.assert_allclose([s for _, _, s in pairs], score.numpy()[order], rtol=1e-5, atol=1e-5)
