"""The data side of training: offline tokenizers (`tokenizers`), the `capture-megatron preprocess`
command writing Megatron's indexed datasets (`preprocess`), and a small real-text corpus from the
Python standard library's docstrings (`corpus`). Submodules are imported on demand: `tokenizers` and
`preprocess` load megatron-core, `corpus` does not."""
