from common import CASES
