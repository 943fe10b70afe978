"""ds4station.kernels"""
