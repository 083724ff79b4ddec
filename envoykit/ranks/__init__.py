"""ranks"""
