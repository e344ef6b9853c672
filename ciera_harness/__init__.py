"""Tooling for the tests and benchmarks, not part of the library: local multi-process runs and
shaped links between local processes.

launch.py  local multi-process runs over gloo sockets
netns.py   shaped links between local processes (network namespaces, tc)
"""
