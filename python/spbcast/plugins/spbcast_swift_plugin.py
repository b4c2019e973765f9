"""The ms-swift plugin of spbcast: ``swift sft ... --external_plugins "$(python -m spbcast.swift)"``.
ms-swift imports it on every rank while it parses its arguments, before it builds the trainer:
from then on only the leader of each SP group runs the SP train loader (docs/swift.md).

It lies alone in its folder: ms-swift puts a plugin's folder on sys.path, where the spbcast
package's own modules (accelerate.py, swift.py, ...) would shadow the packages of those names."""

import spbcast.swift

spbcast.swift.enable()
