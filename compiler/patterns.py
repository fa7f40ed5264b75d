"""The plugin API for fusion patterns: `from fuseguard.compiler.patterns import PatternRule, register_pattern`.

The table itself and its rules live in `fusion/patterns.py` (the rule vocabulary in `fusion/rules.py`, the cost
functions in `fusion/cost.py`); this module is the stable name plugins import, so the table can move inside the
package without breaking them. Every name is the very object of its home module (one registry, not a copy).
"""

from .fusion.cost import (CostEstimate, decide_at, decomposition_cost, dims_for_cost, intermediate_traffic_cost,
                          merged_nodes, tensor_bytes)
from .fusion.patterns import (PATTERNS, Match, PatternRule, pattern_names, register_pattern, rules,
                              unregister_pattern)
from .hw.hardware import Hardware, for_target

__all__ = ["PATTERNS", "CostEstimate", "Hardware", "Match", "PatternRule", "decide_at", "decomposition_cost",
           "dims_for_cost", "for_target", "intermediate_traffic_cost", "merged_nodes", "pattern_names",
           "register_pattern", "rules", "tensor_bytes", "unregister_pattern"]
