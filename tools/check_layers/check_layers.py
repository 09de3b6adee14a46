#!/usr/bin/env python3
"""Checks that every header of include/moe_route includes only its own module
and lower layers (layers.txt beside this file). Exit 1 names every include
that goes up or sideways; --self-test checks that a back-up include fails."""
import os
import re
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def read_layers(path):
    layers = []
    for line in open(path):
        line = line.split('#', 1)[0].split()
        if line:
            layers.append(line)
    return {module: level for level, modules in enumerate(layers) for module in modules}


def module_of(header, modules):
    best = None
    for m in modules:
        if header == m or (m.endswith('/') and header.startswith(m)):
            if best is None or len(m) > len(best):
                best = m
    return best


def check(root, layers):
    """Returns the violations under root (the include/moe_route folder)."""
    errors = []
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith(('.hpp', '.cuh')):
                continue
            path = os.path.join(folder, name)
            header = os.path.relpath(path, root).replace(os.sep, '/')
            own = module_of(header, layers)
            if own is None:
                errors.append(f'{header}: in no layer of layers.txt')
                continue
            for target in INCLUDE.findall(open(path).read()):
                if target.startswith('moe_route/'):
                    target = target[len('moe_route/'):]
                elif '"' in target or not os.path.exists(os.path.join(folder, target)):
                    continue  # a system or third-party header
                else:  # a relative include: the library's own headers use <moe_route/...>
                    errors.append(f'{header}: includes "{target}" by a relative path; use <moe_route/...>')
                    continue
                dep = module_of(target, layers)
                if dep is None:
                    errors.append(f'{header}: includes {target}, which is in no layer')
                elif dep != own and layers[dep] >= layers[own]:
                    where = 'a higher layer' if layers[dep] > layers[own] else 'another module of its layer'
                    errors.append(f'{header} ({own}) includes {target} ({dep}, {where})')
    return errors


def self_test(layers_path):
    layers = read_layers(layers_path)
    with tempfile.TemporaryDirectory() as root:
        def write(name, text):
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            open(os.path.join(root, name), 'w').write(text)
        write('config.hpp', '#pragma once\n')
        write('router.hpp', '#include <moe_route/config.hpp>\n')
        write('gating/softmax.hpp', '#include <moe_route/config.hpp>\n')
        if check(root, layers):
            return 'a tree that keeps the layers was rejected'
        write('gating/softmax.hpp', '#include <moe_route/router.hpp>\n')  # up a layer
        if not check(root, layers):
            return 'an include that goes up a layer passed'
        write('gating/softmax.hpp', '#include <moe_route/selection/top_k.hpp>\n')  # sideways
        write('selection/top_k.hpp', '#pragma once\n')
        if not check(root, layers):
            return 'an include of another module of the same layer passed'
    return None


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    layers_path = os.path.join(here, 'layers.txt')
    if '--self-test' in sys.argv:
        problem = self_test(layers_path)
        print(problem or 'check_layers self-test: violations are caught')
        return 1 if problem else 0
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, '..', '..', 'include', 'moe_route')
    errors = check(root, read_layers(layers_path))
    for e in errors:
        print(e)
    print(f'include layers: {len(errors)} violation(s)')
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
