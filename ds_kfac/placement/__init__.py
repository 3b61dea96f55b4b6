"""Placement: where each layer's gradient lies and which rank preconditions it."""

from .gradients import Fragment, GradientLayout, whole_grad

__all__ = ["Fragment", "GradientLayout", "whole_grad"]
