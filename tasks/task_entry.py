"""Task names (--task) and where their classes live.

A task is one file in tasks/ with a Task subclass (see tasks/task.py); register it with one line
here: 'my_task': 'tasks.my_task:MyTask', (nothing heavy is imported: `--help` reads this before torch).
"""

from utils.registry import load_entry

TASKS = {
    'classify': 'tasks.classify:ClassifyTask',
    'segment': 'tasks.segment:SegmentTask',
    'detect': 'tasks.detect:DetectTask',
}


def task_class(name):
    """The Task class registered as `name`."""
    return load_entry(TASKS, name, '--task', 'tasks/task_entry.py')
