"""ds4station.hardware"""
