"""Measuring one configuration: the Spec, the protocol under the guard, the device's
rates and the model zoo."""
