#!/usr/bin/env python3
"""The run cache of study_common.run_jobs and its atomic table writes: a cached result that reads back is reused; one that does
not (truncated by a kill, or JSON that is not an object) is reported, removed and run again; a job
whose output is not a JSON object ends the study without caching it. Standard library only:

    python3 examples/moe_lm/test_study_common.py
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study_common import Job, csv_text, run_jobs, write_atomic  # noqa: E402

# A stand-in for moe_lm: leaves a marker file (so a test sees that it ran) and prints a JSON object.
FAKE_RUN = ("import json, pathlib, sys; name, markers = sys.argv[1:3]; "
            "pathlib.Path(markers, name).touch(); print(json.dumps({'name': name, 'fresh': True}))")


class RunJobsCache(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.markers = os.path.join(self.dir.name, "markers")
        os.makedirs(self.markers)

    def tearDown(self):
        self.dir.cleanup()

    def job(self, name, code=FAKE_RUN):
        return Job(name, [sys.executable, "-c", code, name, self.markers], os.path.join(self.dir.name, name + ".json"))

    def cache(self, name, text):
        with open(os.path.join(self.dir.name, name + ".json"), "w") as f:
            f.write(text)

    def ran(self, name):
        return os.path.exists(os.path.join(self.markers, name))

    def run_quietly(self, jobs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            results = run_jobs(jobs, 2, "test_study")
        return results, printed.getvalue()

    def test_unreadable_entries_run_again(self):
        self.cache("valid", json.dumps({"name": "valid", "fresh": False}))
        self.cache("truncated", '{"name": "truncated", "fr')
        self.cache("not_object", "[1, 2, 3]")
        jobs = [self.job(n) for n in ("valid", "truncated", "not_object", "missing")]
        results, printed = self.run_quietly(jobs)

        self.assertFalse(self.ran("valid"))
        self.assertEqual(results["valid"], {"name": "valid", "fresh": False})
        for name in ("truncated", "not_object", "missing"):
            self.assertTrue(self.ran(name), name)
            self.assertEqual(results[name], {"name": name, "fresh": True})
            with open(os.path.join(self.dir.name, name + ".json")) as f:
                self.assertEqual(json.load(f), results[name], "the fresh result replaces the cached one")
        lines = printed.splitlines()
        for name, reason in (("truncated", "Unterminated string"), ("not_object", "an array, not a JSON object")):
            path = os.path.join(self.dir.name, name + ".json")
            self.assertEqual(sum(line.startswith(f"test_study: cached {path} is unreadable (") and reason in line
                                 and line.endswith("; running it again") for line in lines), 1, printed)
        self.assertIn("test_study: 1 of 4 runs cached", printed)

    def test_fresh_output_that_is_not_an_object_is_not_cached(self):
        job = self.job("prints_array", "print('[1, 2]')")
        with self.assertRaises(SystemExit) as stop, contextlib.redirect_stdout(io.StringIO()):
            run_jobs([job], 1, "test_study")
        self.assertIn("printed no JSON object (an array, not a JSON object)", str(stop.exception.code))
        self.assertFalse(os.path.exists(job.path))


class WriteAtomic(unittest.TestCase):
    def test_replaces_whole_and_leaves_no_temporary(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "table.csv")
            write_atomic(path, "old\n")
            write_atomic(path, csv_text([["a", 1], ["b,c", 2.5]]))
            with open(path, newline="") as f:
                self.assertEqual(f.read(), 'a,1\r\n"b,c",2.5\r\n')
            self.assertEqual(os.listdir(d), ["table.csv"])

    def test_a_failed_write_keeps_the_old_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "table.json")
            write_atomic(path, "{}")
            with self.assertRaises(TypeError):
                write_atomic(path, None)  # fails inside the write, after the temporary is opened
            with open(path) as f:
                self.assertEqual(f.read(), "{}")
            self.assertEqual(os.listdir(d), ["table.json"])


if __name__ == "__main__":
    unittest.main()
