"""ds4station.tui"""
