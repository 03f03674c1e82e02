"""Mining a corpus: sentences read and batched (`text_files`, `corpus`), every key's coefficients folded
into a bounded, mergeable state (`state`, with `bins`, `order`, `fold_cpu`; run by `batches`), a layer of
it as stored (`mined_layer`), the shaded sentences (`sentence_coefficients`). Torch-free to import: the
web process reads `text_files` and `mined_layer`'s constants."""
