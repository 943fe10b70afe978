"""The control panel's screens: the dashboard (default), the plan editor (p) and the key help (?)."""

from .dashboard import DashboardScreen
from .help import HelpScreen
from .plan import PlanScreen

__all__ = ["DashboardScreen", "HelpScreen", "PlanScreen"]
