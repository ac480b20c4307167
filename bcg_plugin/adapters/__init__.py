"""Host adapters: one thin plugin per engine, implementing :mod:`bcg_plugin.hookspecs`."""
