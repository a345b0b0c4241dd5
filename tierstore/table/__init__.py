"""What a table is: its spec and presets, row formats, the Hugging Face config it
comes from and the checkpoint layout it is read from (checkpoint), the tokenizer
compression map, the n-gram hasher, frequency profiles.

Entry points: spec.EngramSpec, spec.preset, formats.RowFormat, hasher.NgramHasher,
tokenizer_map.load_or_build, hf_config.spec_from_config, profile.build_profile.
Nothing here knows where rows are stored.
"""
