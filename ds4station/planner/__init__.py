"""ds4station.planner"""
