"""ds4station.server"""
