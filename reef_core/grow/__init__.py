"""grow"""
