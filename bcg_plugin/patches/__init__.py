"""What bcg-plugin patches in each host engine version, one module per patched host symbol.

See ``patches/README.md`` for the table of targets, reasons, version ranges and removal conditions.
"""
