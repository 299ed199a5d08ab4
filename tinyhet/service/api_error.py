"""The error every check of a request body raises: an HTTP status (4xx) and the field to change, in OpenAI's error shape."""

class ApiError(ValueError):
  def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code
