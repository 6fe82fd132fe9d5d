"""What each node has, and what that means for the job: discovery (through one seam, so
recorded machines stand in for real ones), the NCCL / gloo environment chosen from it,
where each mesh axis's traffic goes, and the check of NCCL's own report.

No torch here: the login node, the driver and the doctor's report use it too.
May import config and plan (the mesh axis table).
"""

from dtk.topology.choose import FabricChoice, Setting, choose
from dtk.topology.discover import discover
from dtk.topology.layout import Layout, plan_layout
from dtk.topology.records import NodeTopology
from dtk.topology.source import LiveSource, RecordedSource, RecordingSource

__all__ = ["FabricChoice", "Layout", "LiveSource", "NodeTopology", "RecordedSource", "RecordingSource", "Setting",
           "choose", "discover", "plan_layout"]
