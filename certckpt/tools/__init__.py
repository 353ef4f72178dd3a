"""The demo and the measurement harness behind ``certckpt envelope``: programs built from the library,
not part of it. Imports every layer below; nothing imports it but the CLI.
"""
