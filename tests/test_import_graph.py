"""No module imports the package it lives in at run time while that package's ``__init__`` imports it
back (lint-imports checks cycles between siblings only; this is the parent's side)."""

from __future__ import annotations

import grimp

PACKAGES = ("indexer", "router", "api", "mocker")


def test_no_module_goes_back_through_its_own_package_init() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        package = module.rpartition(".")[0]
        while package:
            if graph.direct_import_exists(importer=module, imported=package):
                chain = graph.find_shortest_chain(importer=package, imported=module)
                if chain is not None:
                    cycles.append(chain)
            package = package.rpartition(".")[0]
    assert cycles == []
