"""The result file's types, charts as values and the arrival schedules: what every other part of load testing reads."""
