"""Megatron-LM's command line, pure Python: the parser generated from the option fields (parser),
every pretrain_gpt.py argument (megatron_lm, megatron_args.json) and what capture-megatron does
with each (capture_megatron.rules.flags), and the parsed flags turned into the typed objects between
stages (args). The argparse Namespace stops here."""
