"""Explanations without an API key: a short description of each memory read off its index, and a score
for how well that description predicts the key on text the run never mined.

`fitting`: the pattern, a token table fitted on a memory's shaded sentences, and a position's match
(numpy; torch-free). `description`: the pattern in words, with its value's top tokens (torch-free).
`scoring`: how well the pattern predicts the key on held-out positions, Pearson and AUROC (torch).
"""
