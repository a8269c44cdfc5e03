"""Work that need not hold up the training step: one thread that writes, in the order it was asked.

Drawing and encoding pictures, writing tracker points, serializing a checkpoint, hashing and fsyncing
it take milliseconds to seconds that the next steps need not wait for. The loop hands them to a
`BackgroundWriter` with what they need already copied (see utils/checkpointer.py's snapshot), and
goes on. One thread keeps the order: a checkpoint's tracker points are on disk before its file, and
its file before the trackers hear that it exists.
"""

import queue
import threading


class BackgroundWriter:
    """Runs jobs one at a time on a thread of its own, in the order they were submitted.

    A job that fails cancels the jobs queued after it (a checkpoint that was not written must not be
    announced as written); its error is raised in the submitting thread at the next `submit` or
    `wait`. `wait()` returns once every job submitted so far has run; `submit` returns an event set
    once that one job has run, failed or been cancelled.
    """

    def __init__(self):
        self._jobs = queue.Queue()
        self._thread = None
        self._error = None
        self._cancelled = False
        self._running = False  # a job is running (or about to): see busy

    def submit(self, function, *args):
        """Run `function(*args)` after the jobs already submitted (raises an earlier job's error first);
        returns a threading.Event set when the job is over (run, failed or cancelled)."""
        self._raise_error()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name='kiln-writer', daemon=True)
            self._thread.start()
        over = threading.Event()
        self._jobs.put((function, args, over))
        return over

    def wait(self):
        """Block until every job submitted so far has run; raise the first error among them."""
        if self._thread is not None:
            self._jobs.join()
        self._raise_error()

    def close(self):
        """Run what is pending, then end the thread (a later `submit` starts a new one). Interrupted (a
        second Ctrl-C), it runs no further job: the one running ends on its own (see `busy`)."""
        if self._thread is not None:
            self._jobs.put(None)
            try:
                self._thread.join()
            except BaseException:
                self._cancelled = True
                raise
            self._thread = None
        self._raise_error()

    def busy(self):
        """Whether a job is running (after a `close` cut short: the thread's is_alive() is no guide then,
        as an interrupted join marks it stopped)."""
        return self._running

    def _work(self):
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            function, args, over = job
            self._running = True  # before reading _cancelled, which close sets before reading this
            try:
                if not self._cancelled:
                    function(*args)
            except BaseException as error:  # noqa: BLE001 - handed to the submitting thread
                self._error, self._cancelled = error, True
            finally:
                self._running = False
                over.set()  # also for a cancelled job: whoever waits for it learns the error at its next submit
                self._jobs.task_done()

    def _raise_error(self):
        if self._error is not None:
            error, self._error = self._error, None
            self._jobs.join()  # what was queued behind the failed job is cancelled, not left to run later
            self._cancelled = False
            raise error
