"""Small widgets of the control panel: one panel each, rendered from data the App hands them."""

from .gpu_panel import GpuPanel
from .live_panel import LivePanel
from .plan_view import PlanSummary, route_table
from .server_panel import ClientsPanel, ServerPanel

__all__ = ["ClientsPanel", "GpuPanel", "LivePanel", "PlanSummary", "ServerPanel", "route_table"]
